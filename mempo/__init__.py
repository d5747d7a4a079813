"""mempo: MemPO (Self-Memory Policy Optimization) as a reproducible pipeline.

The library holds all logic; `mempo --help` lists the stage commands. Each stage is one
plain typed function in its module; `mempo/commands/` only parses arguments and calls it.
"""

__version__ = "0.1.0"
