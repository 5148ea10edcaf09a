"""CIFAR-10 with ResNet-18, Horovod with MiCRO (see cifar10.py for the script and its flags):

    horovodrun -np 4 -H localhost:4 --gloo python train/cifar10_resnet18.py --data-dir data
"""

from cifar10 import main

main("resnet18")
