"""What a bench run sends: seeded workloads, prompts and their token counts, ShareGPT
files, Mooncake traces replayed as token blocks, and arrival times."""
