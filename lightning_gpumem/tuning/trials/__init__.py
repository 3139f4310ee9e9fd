"""Trials on the user's own Trainer.

The session that runs and undoes them, what it saves and restores, the loaders, the model state, one trial
measured, and the bench the tuner and the planner share.
"""
