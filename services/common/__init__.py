"""Pieces shared by the prefill and decode scheduler services."""
