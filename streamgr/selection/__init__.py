"""Selection: the SID vocabulary (catalog, CSR trie of valid prefixes) and, as they land,
beam-search policies and large-K top-k.

Must not import engine, cache, protocol or server code.
"""
