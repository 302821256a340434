"""Pieces every process shares: wire protocol, transport, config, metrics, logging."""
