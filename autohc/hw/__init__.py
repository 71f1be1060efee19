"""What this machine is: CPU model, ISA flags, cores, caches and NUMA nodes (cpu)."""
