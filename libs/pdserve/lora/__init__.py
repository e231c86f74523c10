"""Multi-LoRA serving (S-LoRA / Punica): PEFT adapters over one base model, mixed in a batch."""
