"""A node on the network: who it is and its proof of the secret (hello), how it is found (announce),
how fast its links are (links).
"""
