"""The names a user may choose between: drafters, acceptance rules, tree modes.

Plain tuples with no MLX import, so front ends can build their argument parsers and
pickers from them before MLX loads (the CLI re-executes itself with OpenBLAS preloaded
only while MLX is not yet imported).
"""

from __future__ import annotations

DRAFTERS = ("none", "model", "ngram", "layerskip", "head", "auto")
ACCEPT_RULES = ("coupled", "rejection")
TREE_MODES = ("auto", "off")
