"""Drafters: one proposer per module behind :class:`mlxspec.engine.drafters.base.Drafter`."""
