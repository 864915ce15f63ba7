"""Triton kernels, one file per family. Pure kernels and their launchers: no torch-level logic."""
