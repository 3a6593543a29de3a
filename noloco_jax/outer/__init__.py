"""Outer methods: the rules (rules.py), who exchanges with whom (pairing.py), the group exchange (exchange.py),
the methods behind config.outer.kind (methods.py, whose all-reduce baselines also communicate), round
compilation (rounds.py) and the paper's hyperparameters (paper.py)."""
