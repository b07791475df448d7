"""The server: hosts a span of transformer blocks and serves them over QUIC.

Run it as ``python -m petals_core.server MODEL [options]``.
"""
