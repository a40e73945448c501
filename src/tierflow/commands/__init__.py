"""tierflow.commands: the verbs (`tierflow pack|inspect|verify|gc|cache|plan|bench|top|report|ckpt|demo`),
thin over the library; the top of the import graph, imported by nothing below it."""

from tierflow.commands.cli import build_parser, main

__all__ = ["build_parser", "main"]
