"""A nanoGPT-sized GPT trained with ``Trainer(strategy="pipeline")``: model, data, callbacks, Hydra entry points."""
