"""The callables that Ray Data's ``map_batches`` runs, one step each:
``PromptRenderer`` (prompts.py), ``Predictor`` (predictor.py, around an engine from engine.py;
a job's predictor renders its prompts itself).
"""
