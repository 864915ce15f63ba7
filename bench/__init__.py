"""`python -m bench`: gradaccel side by side with stock PyTorch. One module per suite."""
