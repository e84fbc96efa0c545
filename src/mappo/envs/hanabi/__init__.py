"""Hanabi (the MAPPO paper's third benchmark), batched on a torch device."""
