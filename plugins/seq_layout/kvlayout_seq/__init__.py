"""The "seq" layout for kvlayout."""
