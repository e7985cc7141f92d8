"""nanogpt-pl: the NanoGPT speedrun recipe as a PyTorch Lightning project."""
