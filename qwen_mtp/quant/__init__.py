"""Weight quantization formats (FP8 with 128x128 block scales)."""
