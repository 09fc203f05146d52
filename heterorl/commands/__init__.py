"""The command line, one module per command or family of commands: each declares its options
(`register_<name>(sub)`) beside the function that runs it; `heterorl.cli` puts them together."""
