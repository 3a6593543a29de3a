"""The inner step: what every replica does on its own between outer rounds.

state.py (TrainState: θ, the inner optimizer state, the outer state, the step) and step.py (the
optimizer, the loss and its gradients, the jittable step over the replicas of one device). Below the
outer methods, the pipeline and the checkpoints, which all build on it; nothing here imports them.
"""
