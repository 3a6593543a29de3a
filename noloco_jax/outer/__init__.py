"""Outer methods: the rules (rules.py), who exchanges with whom (pairing.py), the collectives (exchange.py) and the methods behind config.outer.kind (methods.py)."""
