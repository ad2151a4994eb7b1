"""Kernel sources (prelude.h + one *.inc body per kernel), shipped as package data."""
