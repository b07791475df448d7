"""Tests of the Hugging Face-facing models: loading, forward, sessions, generate(), fine-tuning."""
