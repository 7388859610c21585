"""kvpress in kvviz: its scorer presses wrapped as kvviz methods, and any press run natively (its own forward),
mapped back to token positions, with the coverage of kvpress's catalog."""
