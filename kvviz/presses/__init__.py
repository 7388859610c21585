"""kvpress's own presses run natively, mapped back to token positions, and their coverage."""
