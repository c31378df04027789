"""The SGLang twin: SGLang's HTTP API and /metrics, with throughput from a performance model.

Run it with ``specd twin``; start it from Python with :class:`specd.twin.process.TwinProcess`.
"""
