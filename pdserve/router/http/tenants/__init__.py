"""Tenants: isolation by API key (salts), the key table, and each tenant's limits."""
