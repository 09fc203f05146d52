"""The command line, one module per command or family of commands: each declares its options
(`register_<name>(sub)`) beside the function that runs it; `heterorl.cli` puts them together,
with the commands other packages add through the `heterorl.commands` entry points (the lab's: lab/commands/).
The modules that do the work (and torch with them) are imported only when a command runs."""
