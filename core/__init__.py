"""The engine and everything it needs. Importing this package imports no torch: the modules
that need it (gpt, trainer, muon, ...) import it themselves, and only the engine process loads them."""
