"""Streaming consumers: objects with ``on_layer(LayerAttention)`` that keep only what a tool needs.

Every consumer lives here, one module per idea, so any tool can use any of them (tools never import each
other). A consumer reads the captured layer, calls pure functions of :mod:`agent_tools.analysis`, and keeps
a few numbers or the slices its caller named; see ``docs/ARCHITECTURE.md``.
"""
