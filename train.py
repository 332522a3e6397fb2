"""Train an image classifier from a composed Hydra config: `python train.py [group=choice ...] [key=value ...]`.

The same command as `python -m trainer` (trainer/cli.py), kept at the top of the checkout.
"""

from trainer.cli import main

if __name__ == "__main__":
    main()
