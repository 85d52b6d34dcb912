"""A stage's caches: what each kind can do, the batched quantized cache, decode groups, the prefix
cache and its disk tier.
"""
