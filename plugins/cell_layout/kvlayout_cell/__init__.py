"""The "cell" layout for kvlayout."""
