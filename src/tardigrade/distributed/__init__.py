"""Distributed checkpointing: what ``save``/``load`` do when ``torch.distributed`` is initialized.

Every step that involves more than one rank goes through :class:`~._collectives.Ranks`, which
turns an error on any rank into the same error on every rank, within a timeout.
"""
