"""Constrained decoding's grammars: JSON schemas (the supported subset), Lark grammars and
the token masks they give, on llguidance (docs/server.md, "Constrained decoding")."""
