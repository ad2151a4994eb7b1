"""Kernel sources (prelude.h, the convert.h header and one *.inc body per kernel), shipped as package data."""
