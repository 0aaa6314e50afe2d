"""The GR runtime, independent of where tensors live: deployments (a generator built from a spec
and checked against its contract), the deployment contract, and the SID step loop
(trie-constrained beam search with candidate-state compaction).

Imports models and selection; must not import engine, protocol or server code.
"""
