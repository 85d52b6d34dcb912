"""The stage side: a worker that holds a layer range of a model and runs frames through it."""
