"""`python -m specscope` (and `torchrun -m specscope`) runs the command line."""

from .cli import app

app()
