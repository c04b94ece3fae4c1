"""Engine core: sequences, block manager, scheduler and the step loop. No torch, numpy or grpc here."""
