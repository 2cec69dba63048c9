"""Hostile and unlucky clients: each test attacks a real server and checks it keeps serving."""
