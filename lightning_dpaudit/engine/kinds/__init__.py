"""Canary kinds: gradient canaries (kinds.gradient) and input canaries (kinds.input), one interface (kinds.base)."""
