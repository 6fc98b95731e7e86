build/obj/proto/fdwire.o: proto/fdwire.c proto/fdwire.h
proto/fdwire.h:
