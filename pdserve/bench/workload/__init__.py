"""What a bench run sends: seeded workloads, prompts and their token counts, ShareGPT
files, and arrival times."""
