"""Trials on the user's own Trainer: the session that runs and undoes them, what it saves and restores, the
loaders, the model state, one trial measured, and the bench the tuner and the planner share.
"""
