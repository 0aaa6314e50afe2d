"""The trace tool: synthetic traces (and, as they land, dataset converters, replay, reports).

May import the engine and client; nothing below it imports this package.
"""
