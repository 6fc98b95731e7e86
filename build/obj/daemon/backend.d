build/obj/daemon/backend.o: daemon/backend.c daemon/backend.h
daemon/backend.h:
