"""The PySide6 desktop app: thin views over the controller, the engine's events and the store."""
