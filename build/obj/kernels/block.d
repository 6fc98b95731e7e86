build/obj/kernels/block.o: kernels/block.c kernels/block.h
kernels/block.h:
