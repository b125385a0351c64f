"""The built-in default models' training: corpus splits and chat examples (``corpus``), the
full-sequence causal forward and losses (``training``), the training command (``train``) and
the loss-curve plot and results table (``plot``).

    python -m tools.default_models.train --device cuda
    python -m tools.default_models.plot --update-doc docs/default-models.md

What the server needs at run time (the corpus reader, the tokenizer trainer, the model
configurations) stays in ``segkv.models``; nothing in ``segkv`` imports this package.
"""
