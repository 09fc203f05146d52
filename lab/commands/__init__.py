"""The lab's commands (`heterorl study`, `attack`, `adversary`, `chaos`, `wan`, `loadtest`), which the lab
adds to the CLI itself: pyproject.toml registers each under the `heterorl.commands` entry points, naming the
module here whose `COMMANDS` declares it (its options beside the function that runs it, as the product's
command modules do), and `heterorl.cli` reads that group. The product never imports the lab; installed
without it, `heterorl` lacks these commands. The studies and rigs (and torch) are imported only when one runs."""
