"""The actors of callboard and the pure cores they drive."""
