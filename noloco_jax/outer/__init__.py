"""Outer methods: their catalogue and rules (methods/), what a method is to the code (base.py), its round's
programs (programs.py), the exchange, codecs, pairings and graphs, stability, and bytes on the wire."""
